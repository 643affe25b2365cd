"""The public API's earlier name: ``from regroup.trainer import elastic`` keeps working for
this release and warns; write ``from regroup import elastic``."""

import sys
import warnings

from regroup import elastic

warnings.warn(
    "regroup.trainer.elastic is now regroup.elastic: write `from regroup import elastic` "
    "(the old name goes in the next release)",
    DeprecationWarning,
    stacklevel=2,
)
sys.modules[__name__] = elastic
