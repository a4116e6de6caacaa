"""mindspeed_flow.overlap"""
