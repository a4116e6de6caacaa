"""Fake `torch_npu.utils.flops_count`: the hardware FLOP counter reads zero under emulation."""


class FlopsCounter:
    def start(self):
        pass

    def stop(self):
        pass

    def pause(self):
        pass

    def resume(self):
        pass

    def get_flops(self):
        return [0, 0]
