"""The one exception type users see: its message is a single line naming the culprit."""


class LegionNNError(Exception):
    """Bad input or a broken invariant; the CLI prints `legion-nn: <message>` and exits non-zero."""


class ShapeError(LegionNNError):
    """A layer cannot accept the shape it is given."""


class VerifyError(LegionNNError):
    """A task graph breaks one of the invariants checked by `verify`."""
