"""mindspeed_flow.runtime"""
