"""The error of a run that cannot go on: raised where the run is built or trained, reported by
the train command as one line with exit status 1."""


class TrainingError(RuntimeError):
    """A run that cannot go on (bad data, non-finite loss): reported as one line, exit status 1."""
