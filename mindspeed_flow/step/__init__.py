"""The step core both hosts share: what one training step does on which rank, decided from sample metadata alone.

`plan.py` holds the step contract (`StepWork`: the packing scheduler's microbatches per backbone DP rank, each
encoder rank's samples in the order the backbone consumes them, who produces and who consumes each embedding) and
the functions every rank calls to derive it identically, with no communication: the torch host's engine, the
MindSpeed-MM flow job and the planner's step simulator all plan through it.
"""
