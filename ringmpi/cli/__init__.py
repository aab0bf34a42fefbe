"""The ``ringmpi`` command: :mod:`.main` (the subcommands), :mod:`.parser` (flags and
help texts), :mod:`.plan` (``ringmpi plan``), :mod:`.bench` (``ringmpi bench``) and
:mod:`.make_data` (``ringmpi make-data``, deterministic sample inputs).
"""
