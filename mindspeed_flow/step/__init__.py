"""The step core both hosts share: what one training step does on which rank, decided from sample metadata alone.

`layout.py` is the one layout type (parts, their DP/TP/PP/CP and global ranks, each encoder part's bridge to the
backbone), validated before any process group exists. `plan.py` holds the step contract (`StepWork`: the packing
scheduler's microbatches per backbone DP rank, each encoder rank's samples in the order the backbone consumes them,
who produces and who consumes each embedding) and the functions every rank calls to derive it identically, with no
communication. `timer.py` and `held.py` hold the busy/wait and held-activation figures each host reports. The torch
host's engine, the MindSpeed-MM flow job, the planner's step simulator and the launch-script writer all use it;
nothing here imports a host, the planner or the bench.
"""
