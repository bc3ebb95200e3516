"""Language-model data: document sources, tokenizers, token shards, packing."""
from .packing import PACKINGS, BatchStream, PackedRows, RowOrder, collate
from .prepare import DataSpec, open_split, prepare_dataset
from .shards import TokenShards, write_token_shards
from .sources import iter_documents, list_files
from .tokenizer import byte_tokenizer, encode_documents, load_tokenizer, train_bpe_tokenizer

__all__ = ["DataSpec", "prepare_dataset", "open_split", "TokenShards", "write_token_shards", "iter_documents",
           "list_files", "byte_tokenizer", "load_tokenizer", "train_bpe_tokenizer", "encode_documents",
           "PackedRows", "BatchStream", "RowOrder", "collate", "PACKINGS"]
