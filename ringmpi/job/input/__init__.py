"""What the batch job reads: :mod:`.scan` (find the sequences, build the plan),
:mod:`.files` (open an input safely; what a file may make the job read),
:mod:`.reader` (one rank's tokens of a batch) and :mod:`.weights` (projection
weights of raw-feature inputs).
"""
