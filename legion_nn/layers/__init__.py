"""Layer kinds; importing this package registers every layer and every op's record."""

from legion_nn.layers import (  # noqa: F401  (registration side effects)
    affine,
    attention,
    batchnorm,
    channel,
    common_access,
    dense,
    dropout,
    embedding,
    evaluate,
    filter,
    group_conv,
    layernorm,
    linear,
    lrn,
    merge,
    nonlinear,
    pool,
    reshape,
    softmax,
    tokens,
)
from legion_nn.layers.affine import FilterA
from legion_nn.layers.attention import (
    FeatureSlice,
    MatMul,
    MergeHeads,
    RowSoftmax,
    SplitHeads,
)
from legion_nn.layers.base import LAYER_KINDS, Layer, layer_from_spec
from legion_nn.layers.batchnorm import BatchNorm
from legion_nn.layers.channel import ChannelAffine, ChannelShuffle
from legion_nn.layers.dense import Dense
from legion_nn.layers.dropout import Dropout
from legion_nn.layers.embedding import Embedding, PositionEmbedding
from legion_nn.layers.evaluate import Evaluate
from legion_nn.layers.filter import Conv, Filter
from legion_nn.layers.layernorm import LayerNorm
from legion_nn.layers.linear import Linear
from legion_nn.layers.lrn import LRN
from legion_nn.layers.merge import Add, Concat
from legion_nn.layers.nonlinear import FilterNL, Relu
from legion_nn.layers.pool import AvgPool, MaxPool
from legion_nn.layers.reshape import Flatten, Reshape
from legion_nn.layers.softmax import Softmax
from legion_nn.layers.tokens import ClassToken, ImageTokens, SelectToken

__all__ = [
    "LAYER_KINDS",
    "LRN",
    "Add",
    "AvgPool",
    "BatchNorm",
    "ChannelAffine",
    "ChannelShuffle",
    "ClassToken",
    "Concat",
    "Conv",
    "Dense",
    "Dropout",
    "Embedding",
    "Evaluate",
    "FeatureSlice",
    "Filter",
    "FilterA",
    "FilterNL",
    "Flatten",
    "ImageTokens",
    "Layer",
    "LayerNorm",
    "Linear",
    "MatMul",
    "MaxPool",
    "MergeHeads",
    "PositionEmbedding",
    "Relu",
    "Reshape",
    "RowSoftmax",
    "SelectToken",
    "Softmax",
    "SplitHeads",
    "layer_from_spec",
]
