"""mindspeed_flow.planner"""
