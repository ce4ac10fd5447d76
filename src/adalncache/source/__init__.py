"""Weight sources: where the projection bytes of a rebuild pass come from.

Two kinds share one small protocol (:class:`WeightSource`), so the cache never cares where bytes
come from: :class:`CheckpointSource` streams safetensors files from disk, :class:`TensorSource`
serves tensors already in memory. The modules, one job each:

* :mod:`.protocol`: ``WeightSource``, ``LayerWeights``, ``Columns``;
* :mod:`.header`: the safetensors dtype table, parsing and validating one file's header;
* :mod:`.files`: which files make a checkpoint, and their fingerprint;
* :mod:`.buffers`: buffers placed at a chosen address modulo N, and the staging pool;
* :mod:`.reads`: the one ``pread`` loop, O_DIRECT for uncached bytes, page-cache residency;
* :mod:`.mapped`: zero-copy views of a mapped file that read only the bytes touched;
* :mod:`.projections`: which projection tensors a spec needs and why one is unusable;
* :mod:`.checkpoint`, :mod:`.memory`: the two sources;
* :mod:`.writer`: the safetensors writer the tools and tests use.
"""

from ..identity.files import FileIdentity
from ..spec import FINAL
from .buffers import ALIGNMENT, aligned_empty
from .checkpoint import CheckpointSource
from .files import CheckpointFiles, checkpoint_files
from .header import SAFETENSORS_DTYPES, SafetensorsHeader, TensorEntry
from .mapped import MappedFile
from .memory import TensorSource
from .protocol import Columns, LayerWeights, WeightSource
from .reads import pread_into, resident_fraction
from .writer import LazyTensor, write_safetensors

__all__ = [
    "ALIGNMENT",
    "FINAL",
    "SAFETENSORS_DTYPES",
    "CheckpointFiles",
    "CheckpointSource",
    "Columns",
    "FileIdentity",
    "LayerWeights",
    "LazyTensor",
    "MappedFile",
    "SafetensorsHeader",
    "TensorEntry",
    "TensorSource",
    "WeightSource",
    "aligned_empty",
    "checkpoint_files",
    "pread_into",
    "resident_fraction",
    "write_safetensors",
]
