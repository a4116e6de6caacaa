"""Test-only: transformers' `VideoMetadata` takes `total_frames` as `total_num_frames`, in the jobs of
`test_transformers_glm45v.py`'s video test (put on their PYTHONPATH; `mindspeed-flow emulate`'s own sitecustomize
chains to this one).

Why: MindSpeed-MM's GLM-4.5V data plugin (`mm_plugin.py`, GLM4.1V `_get_mm_inputs`) describes each video with
`{"fps", "duration", "total_frames"}`; its GLM-4.5V README installs transformers from a development commit for that
model, while the released transformers this project's MindSpeed-MM venv pins (4.57.x, as MindSpeed-MM's own
pyproject) names the field `total_num_frames` and rejects the other. Unpatched and flow jobs alike get this, so
the test compares the flow job's handling of GLM-4.5V's videos, not the two packages' versions.
"""
from mindspeed_flow.utils.import_hooks import after_import


def _accept_total_frames(module) -> None:
    base = module.VideoMetadata

    class VideoMetadata(base):  # the same dataclass fields; one more spelling of the frame count
        def __init__(self, total_num_frames=None, total_frames=None, **fields):
            super().__init__(total_num_frames if total_num_frames is not None else total_frames, **fields)

    module.VideoMetadata = VideoMetadata


after_import("transformers.video_utils", _accept_total_frames)
