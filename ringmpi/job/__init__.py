"""The HDF5 batch job behind ``ringmpi run``.

Data flow: :mod:`.input.scan` (scan the inputs: one :class:`.plan.Plan`) ->
:mod:`.resources` (memory budget, batches, threads) -> :mod:`.input.reader` (each
rank's tokens) -> ring attention -> :mod:`.output` (per-rank part files and their
index, or one file by parallel HDF5) -> :mod:`.verify` (dense check). :mod:`.run`
sets the job up from an :class:`ringmpi.spec.AttentionSpec` (what is computed) and
:class:`.options.JobOptions` (how); :mod:`.loop` is the sequence loop and
:mod:`.report` the start line, progress and summary.
"""
