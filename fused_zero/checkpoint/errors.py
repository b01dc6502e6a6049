"""The one exception of fused_zero.checkpoint."""


class CheckpointError(RuntimeError):
    """A checkpoint on disk is missing, incomplete, malformed or corrupted (the message names the file)."""


CORRUPTED = "the checkpoint is corrupted; restore the file or load an older tag"
