"""The data plane: DataProto, its helpers, and zero-copy serialization."""

from .batch_ops import (
    collate_fn,
    fold_batch_dim,
    pad_dataproto_to_divisor,
    unfold_batch_dim,
    unpad_dataproto,
)
from .config import AUTO_PADDING_ENV, AUTO_PADDING_KEY, PADDING_SIZE_KEY, DataProtoConfig
from .data_proto import DataProto, DataProtoItem
from .distributed import all_gather_data_proto
from .future import DataProtoFuture
from .serialization import (
    deserialize_dataproto,
    deserialize_tensor,
    deserialize_tensordict,
    serialize_dataproto,
    serialize_tensor,
    serialize_tensordict,
    sizeof_dataproto,
    sizeof_tensor,
    sizeof_tensordict,
)
from .tensordict_ops import list_of_dict_to_dict_of_list, union_numpy_dict, union_tensor_dict

_padding_size_key = PADDING_SIZE_KEY  # verl's spelling

__all__ = [
    "AUTO_PADDING_ENV",
    "AUTO_PADDING_KEY",
    "PADDING_SIZE_KEY",
    "DataProto",
    "DataProtoConfig",
    "DataProtoFuture",
    "DataProtoItem",
    "all_gather_data_proto",
    "collate_fn",
    "deserialize_dataproto",
    "deserialize_tensor",
    "deserialize_tensordict",
    "fold_batch_dim",
    "list_of_dict_to_dict_of_list",
    "pad_dataproto_to_divisor",
    "serialize_dataproto",
    "serialize_tensor",
    "serialize_tensordict",
    "sizeof_dataproto",
    "sizeof_tensor",
    "sizeof_tensordict",
    "unfold_batch_dim",
    "union_numpy_dict",
    "union_tensor_dict",
    "unpad_dataproto",
]
