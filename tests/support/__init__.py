"""What the tests share, imported as `tests.support.<module>`: the repository's paths and the
shortened quick start (`paths`), real launches of `mpirun` and the plot command (`launch`), the
checks of a run's outputs and of a picture (`outputs`), the small nets and gradient helpers of
the in-process tests (`nets`), fake files in the upstream datasets' formats
(`upstream_formats`, `idx_files`), and folders of pictures as users keep them (`pictures`)."""
