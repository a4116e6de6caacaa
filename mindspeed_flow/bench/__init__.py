"""mindspeed_flow.bench"""
