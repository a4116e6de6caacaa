"""`mindspeed-flow bench pool` runs end to end on two real gloo ranks and prints one row per item size; bad
options are refused by name. (Its figures are for reading, not asserting: no timing assertions here.)"""
from __future__ import annotations

import pytest

from mindspeed_flow.bench import pool as bench_pool


@pytest.mark.parametrize("batch", [1, 16])
def test_bench_pool_prints_one_row_per_size_with_exact_message_counts(batch: int,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_pool.main(["--tokens", "2,8", "--hidden", "4", "--items", "3", "--repeats", "2",
                            "--max-batch-items", str(batch)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert "medians of 2 interleaved repeats" in lines[0]
    rows = [line.split() for line in lines[2:]]
    assert [int(r[0]) for r in rows] == [2, 8]
    for r in rows:
        many_msgs, header_msgs = float(r[3]), float(r[5])
        assert many_msgs == (3.0 if batch == 1 else 1.0)  # put_many: one message per batch of `batch` items
        if batch == 1:
            assert header_msgs == 3.0  # one item per message: exactly one message per put
        else:
            assert 1.0 <= header_msgs <= 3.0  # coalescing never adds messages
        assert len(r) == 11 and all(float(x) > 0 for x in r[8:])  # the three ratios were measured


@pytest.mark.parametrize("argv, field", [(["--max-batch-items", "0"], "--max-batch-items"),
                                         (["--tokens", "64,x"], "--tokens"),
                                         (["--repeats", "0"], "--repeats"),
                                         (["--capacity-mb", "0"], "--capacity-mb")])
def test_bench_pool_refuses_bad_options_by_name(argv: list[str], field: str,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        bench_pool.main(argv)
    assert field in capsys.readouterr().err
