"""Process plumbing every part of ringmpi leans on, and none of it attention.

:mod:`.env` (every environment variable, one registry), :mod:`.files` (private,
exclusive, atomic files on a shared machine), :mod:`.direct_io` (reads and writes
that bypass the page cache), :mod:`.interrupt` (Ctrl-C and SIGTERM as a flag),
:mod:`.watchdog` (bounded waits on other ranks), :mod:`.launch` (did the launcher
form one communicator?), :mod:`.faults` (the tests' fault-injection seam) and
:mod:`.kernel_files` (where the kernel sources are).
"""
