"""mindspeed_flow.packing"""
