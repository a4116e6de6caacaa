"""mindspeed_flow.hosts.mindspeed_mm"""
