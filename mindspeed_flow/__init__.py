"""mindspeed-flow: train vision-language models with the vision encoder and the LLM backbone in separate
process groups, joined producer-to-consumer through a unified embedding pool.

Importing this package never imports torch_npu, mindspeed, mindspeed_mm or megatron: those are loaded lazily
by `mindspeed_flow.accelerator` (torch_npu, only when installed) and `mindspeed_flow.hosts.mindspeed_mm`.
"""

__version__ = "0.1.0"
