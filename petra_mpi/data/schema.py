"""The HDF5 dataset schema: what the packers (petra_mpi/prep) write and the readers (source.py,
text.py) and `verify` check. docs/data.md explains each field.

Images (one file holds both splits):
  /train/images, /val/images   uint8 (N, H, W, 3) RGB, chunked along N
  /train/labels, /val/labels   int64 (N,), values in [0, num_classes)
  root attrs: schema_version, num_classes, mean, std (3 floats, training images, 0-1 scale),
              source (str); optional /classes (utf-8 names), hflip.
JPEG variant (full-size ImageNet), in place of <split>/images:
  /<split>/jpeg     uint8 (total_bytes,)  every encoded JPEG, concatenated
  /<split>/offsets  int64 (N + 1,)        image i = jpeg[offsets[i]:offsets[i + 1]]
  root attr image_size = the shorter side of every image.
Tokens (the language models):
  /train/tokens, /val/tokens  uint8 (vocabulary <= 256) or int32 (N,), token ids, chunked
  root attrs: schema_version, num_classes (vocabulary size), kind="tokens",
              vocab ("bytes" | "char"), bytes_per_token (UTF-8 bytes per token of the val split,
              1.0 for bytes: turns nats per token into bits per byte), source (str)
  /vocab (char only): the vocabulary as one UTF-8 string, token i = its i-th character
"""
SCHEMA_VERSION = 1
SPLITS = ("train", "val")
