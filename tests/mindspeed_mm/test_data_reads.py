"""Each side reads only what it needs: a MindSpeed-MM flow job planned from the metadata index vs the same job
reading whole global batches, on the tiny set (encoder DP 2 + decoder PP 2, 3 iterations, packed microbatches).

- the losses are identical (same samples, same order, same content where it is used);
- decoder ranks (both pipeline stages) load 0 bytes of pixels; each encoder replica loads the pixels of its own
  samples only: the two replicas' bytes add up to what every rank read before, and each is less;
- the first run builds the index once (one rank; the others wait and read it), a second run reuses it, and a run
  after the data file changed builds a new one.

Each run prints its ranks' exit lines (`read N samples, X bytes of pixels; peak host memory M MiB`).
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from flow_helpers import nranks, write_recipe

from mindspeed_flow.emulation.jobs import TinyJob

pytestmark = [pytest.mark.mindspeed_mm, pytest.mark.slow, pytest.mark.timeout(2400)]

ENC, DEC = {"dp": 2, "tp": 1}, {"dp": 1, "tp": 1, "pp": 2}
READ = re.compile(r"\[mindspeed-flow\] rank (\d+) \((\w+)[^)]*\) read (\d+) samples, (\d+) bytes of pixels; "
                  r"peak host memory (\d+) MiB")
INDEX = re.compile(r"\[mindspeed-flow\] rank (\d+) \([^)]*\) metadata index: (built|reused) ")


def _reads(output: str) -> dict[int, tuple[str, int, int, int]]:
    return {int(r): (part, int(n), int(b), int(m)) for r, part, n, b, m in READ.findall(output)}


def _own_data(tiny_assets: dict, root: Path) -> dict:
    """The tiny set in a folder of its own (its own data file and MindSpeed-MM cache), the shared processor."""
    from mindspeed_flow.emulation import tiny

    (root / "data").mkdir(parents=True)
    shutil.copy(tiny_assets["samples"], root / "data" / "samples.json")
    (root / "processor").symlink_to(tiny_assets["processor"])
    model, data = tiny.write_configs(root)
    return {"model": model, "data": data, "samples": root / "data" / "samples.json"}


def test_each_side_reads_only_what_it_needs(tiny_assets, run_job, tmp_path, monkeypatch) -> None:
    own = _own_data(tiny_assets, tmp_path / "tiny")
    recipe = write_recipe(tmp_path / "flow.yaml", ENC, DEC)
    n = nranks(ENC, DEC)

    def job(iters: int) -> list[str]:
        return TinyJob(own["model"], own["data"], train_iters=iters, global_batch_size=4,
                       extra=["--calculate-per-token-loss", "--variable-seq-lengths"]).argv()

    monkeypatch.setenv("MSF_FLOW_DATA_READS", "whole")
    whole = run_job("whole_reads", job(3), nproc=n, flow_recipe=recipe)
    whole.assert_trained(3)
    monkeypatch.delenv("MSF_FLOW_DATA_READS")
    indexed = run_job("index_reads", job(3), nproc=n, flow_recipe=recipe)
    indexed.assert_trained(3)
    before, after = _reads(whole.output), _reads(indexed.output)
    print("whole reads (part, samples, pixel bytes, peak MiB):", before)
    print("index reads (part, samples, pixel bytes, peak MiB):", after)
    assert indexed.losses == whole.losses, (indexed.losses, whole.losses)
    assert sorted(before) == sorted(after) == list(range(n))
    total = before[0][2]
    assert total > 0 and all(b == total for _, _, b, _ in before.values())  # every rank read every pixel
    encoders = [after[r] for r in range(n) if after[r][0] == "encoder"]
    decoders = [after[r] for r in range(n) if after[r][0] == "decoder"]
    assert len(encoders) == 2 and len(decoders) == 2
    assert all(b == 0 for _, _, b, _ in decoders), decoders
    assert all(s == 12 for _, s, _, _ in decoders), decoders  # both stages: every sample of the one DP replica
    assert sum(b for _, _, b, _ in encoders) == total and all(0 < b < total for _, _, b, _ in encoders), encoders
    built = INDEX.findall(indexed.output)
    assert sorted(int(r) for r, _ in built) == list(range(n)), built
    assert [what for _, what in built].count("built") == 1, built  # one rank built it, the others read it

    again = run_job("index_reused", job(1), nproc=n, flow_recipe=recipe)
    again.assert_trained(1)
    assert sorted(what for _, what in INDEX.findall(again.output)) == ["reused"] * n, again.output[-3000:]

    samples = json.loads(own["samples"].read_text())
    samples[0]["messages"][1]["content"] += " indeed"
    own["samples"].write_text(json.dumps(samples, indent=1))
    changed = run_job("index_rebuilt", job(1), nproc=n, flow_recipe=recipe)
    changed.assert_trained(1)
    assert [what for _, what in INDEX.findall(changed.output)].count("built") == 1, changed.output[-3000:]
