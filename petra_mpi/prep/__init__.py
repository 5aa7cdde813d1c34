"""Offline packers that turn public image datasets into the HDF5 file petra_mpi reads.

One module per source, each a command line (`python -m petra_mpi.prep.<source> --help`):
`cifar`, `imagenet32`, `imagenet`, `synthetic`, and `verify` to check a packed file.
The schema they all write is described in `common.py` and in docs/data.md.
"""
