"""The benchmark library behind ``attnlab bench`` and ``make bench-gpu``: what is measured and how it
is printed and written.

One module per benchmark (``attention``: op time and memory against length; ``bytes_moved`` with
``byte_count``: the bytes an op moves against its floor; ``training``: samples/s per task;
``threads``: CPU thread settings under load; ``generate``: time per new token; ``authors``: distance
to the authors' published layers; ``gpu_check`` and ``gpu_results``: the GPU check's first and last
steps), and ``backends``, the one table of op names and inputs that ``attention`` and ``bytes_moved``
share. Every function is usable without the command line; ``attnlab.cli`` only parses arguments and
calls them. Figures are printed, never asserted.
"""
