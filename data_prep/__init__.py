"""The packers' old command names: `python -m data_prep.<source>` runs
`python -m petra_mpi.prep.<source>` (the packers live in petra_mpi/prep)."""
