"""mindspeed_flow.resilience"""
