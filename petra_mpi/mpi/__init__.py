"""Everything that talks MPI: start-up and rank placement (world), point-to-point messages
(transport), the one-rank-per-stage engine (engine) and the replicas' gradient average (replicas)."""
