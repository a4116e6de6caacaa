"""mindspeed_flow.hosts.torch"""
