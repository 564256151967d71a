"""The Llama-family model's layers, one module per kind, each in its tensor-parallel form (with one rank it is
the plain layer): ``linear`` (column- and row-parallel), ``embed_head`` (vocabulary-parallel embedding and LM
head), ``attention`` (this rank's heads over the paged KV cache), ``layernorm``, ``rotary_embedding`` and
``activation``. Each picks its kernel (the compiled CPU kernels, oneDNN or PyTorch) when it is built.
``parallel`` is how a layer sees the other ranks."""
