"""mindspeed_flow_patches: the MindSpeed-MM monkey-patch set (installed from patches/ as its own subpackage).

Nothing here imports mindspeed, mindspeed_mm or megatron at module top; patches are registered through
`mindspeed.patch_utils.MindSpeedPatchesManager` by the functions in the submodules, on an Ascend (or emulated)
machine only.
"""
