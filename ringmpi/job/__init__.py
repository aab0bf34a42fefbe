"""The HDF5 batch job behind ``ringmpi run``.

Data flow: :mod:`.schema` (scan the inputs, one Plan) -> :mod:`.budget` (memory
check) -> :mod:`.reader` (each rank's tokens) -> ring attention -> :mod:`.store`
(per-rank parts, markers, virtual-dataset file) -> :mod:`.verify` (dense check).
:mod:`.run` sets the job up from an :class:`ringmpi.spec.AttentionSpec` (what is
computed) and :class:`.config.JobOptions` (how), :mod:`.loop` is the sequence loop,
:mod:`.progress` the progress display, :mod:`.sample` the sample-data generator.
"""
