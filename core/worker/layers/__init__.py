"""The layers model files wire together, each written once for every architecture.

One module per concept: norm (RMSNorm), rotary (RoPE and its scaling variants), linear
(replicated, column-, row- and QKV-parallel linears with their tensor-parallel sharding,
each run by its linear method), plain_linear (the plain method every linear starts
with), attention (the layer around the AttentionBackend), mlp (gated MLP), embedding
(vocabulary embedding and LM head, tied or not).

Loading a checkpoint: every parameter carries a weight loader (weight_loader.py) that
takes a full Hugging Face tensor and copies this rank's part of it into place; a fused
parameter (q/k/v into qkv_proj, gate/up into gate_up_proj) takes each of its tensors by
shard id. A model file declares which checkpoint names feed which fused layer
(`packed_modules_mapping`) and calls checkpoint.load_checkpoint. Which linear method
runs each linear layer, and its processing after loading (packing for the bf16 CPU
kernels, quantizing), is the model loader's (worker/linear_methods.py), not the model's.
"""
