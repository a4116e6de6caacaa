"""mindspeed_flow.pool"""
