"""mindspeed_flow.config"""
