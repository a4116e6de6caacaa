"""mindspeed_flow.data"""
