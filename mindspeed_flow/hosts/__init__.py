"""mindspeed_flow.hosts"""
