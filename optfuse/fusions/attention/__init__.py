"""Attention: o = softmax(scale * q @ k^T + bias) @ v, per head  ->  optfuse::FlashAttention.

The rules match the math, not one model's template: a Softmax over the last axis between two
MatMuls, with every step the torch exporters (TorchScript and dynamo; transformers' eager and SDPA
attention) write around it as an alternative::

    q ─► [Mul(√s) | Div(c)] ─────────────────────────────────────────────┐
                                                                          MatMul ─► [Mul(s) | Div(c)] ─┐
    k ─► [repeat_kv] ─► Transpose(0,1,3,2) ─┐                            │                            │
    k_bshd ─► Transpose(0,2,3,1) ───────────┼─► [Mul(√s) | Div(c)] ──────┘                            │
    k ─► [repeat_kv] ─► Reshape(-1,S,D) ─► Transpose(0,2,1) ─► Reshape(B,H,D,S)   (dynamo SDPA)     │
    any kᵀ [B,H,D,Sk] ─┘                                                                              │
                                                                                                      ▼
        ┌─ attention.additive:    [+ bias] [+ bias2]                       (padding / causal / position bias)
        └─ attention.masked_fill: [+ bias2] Where(cond, ., fill) | Where(cond, fill, .) [+ bias]
                                  (bias2: a position bias added before the masked_fill, MPT's ALiBi)
                                                                                                      │
             [Cast] ─► Softmax(axis=-1) ─► [Cast] ─► [Where(IsNaN(p), 0, p)] [Dropout(eval)] ─► MatMul ─► o
                                                                                                 ▲
    v ─► [repeat_kv] ────────────────────────────────────────────────────────────────────────────┘

    repeat_kv (GQA):  Reshape(Expand(Unsqueeze(x, axes=[2]), [B,Hkv,G,S,D]), [B,Hkv*G,S,D])

- ``attention.batched``: 3-D attention over heads merged into the batch (BLOOM's baddbmm + ALiBi,
  DeBERTa-v2)::

      q, k, v [B,H,S,D] ─► Reshape [B*H,S,D] ─► MatMul(q3, Transpose(k3)) [scale] [+ bias3 (ALiBi)]
        ─► Reshape [B,H,S,S] ─► [+ mask | Where(cond, ., fill)] ─► Softmax ─► Reshape [B*H,S,S]
        ─► MatMul(., v3) ─► Reshape [B,H,S,D] = o

  the fused node reads the 4-D q, k, v and writes the final 4-D output; a 3-D bias term is split
  back into heads (new Unsqueeze + Reshape [-1, H, 0, 0]). A 3-D output that something outside the
  match also reads (BLOOM's TorchScript ``_merge_heads`` reads its shape) stays, as the fused output
  reshaped by q's own [B*H, S, D] target (a new Reshape; ``info["kept_3d_output"]``).
- ``attention.onnx``: ONNX's own ``Attention`` op (opset 23+) with 4-D q/k/v, an optional bool or
  additive ``attn_mask``, ``is_causal``, ``scale`` (no cache inputs, no softcap, only output Y used).
- ``attention.unrecognized``: never fuses; reports a Softmax -> MatMul that no rule above took,
  with the ops that produced its scores (e.g. BLOOM's 3-D baddbmm scores), and a Softmax between
  products whose probabilities reach the value product another way (Longformer's sliding chunks,
  BigBird's block gathers), so the report says why.

What the fused node gets:

- q as matched (after rotary embeddings, which stay outside; a scalar Mul/Div on q, on kᵀ and on
  the scores is folded into ``scale`` when it is a constant or computed from static dims, such as
  TorchScript's ``1 / sqrt(q.size(-1))``; any other scale on the scores is rejected);
- k in [B, Hkv, Sk, D]: the tensor before the transpose; when the head split wrote kᵀ directly
  (``Transpose(perm=[0,2,3,1])`` of [B, S, H, D]) a new ``Transpose(perm=[0,2,1,3])`` of the same
  input gives k (an existing one is reused); for any other kᵀ a new ``Transpose(perm=[0,1,3,2])``;
- k and v before ``repeat_kv`` when both are repeated that way (``num_kv_heads`` = their heads);
  otherwise the repeated tensors (``num_kv_heads = num_heads``, always exact);
- a soft-cap ``c * tanh(s / c)`` of the scaled scores (Gemma 2: ``Div(c)`` or ``Mul(1 / c)``, then
  ``Tanh``, then ``Mul(c)``, before the mask) as ``softcap = c``; other Tanh factors are rejected;
- the mask, by what it computes (see ``mask_class``; the parameters in ``mask_bias``), recorded as
  ``info["mask_class"]`` (and ``info["window"]`` = w for windows):

    none                 no bias (a scalar 0: the reference function needs 4 inputs)
    causal               causal=1, no bias
    padding              the key-padding row of the mask, [B, 1, 1, Sk] (one ``Slice`` of the
                         mask's last query row, shared by all layers)
    causal+padding       causal=1 and that row
    sliding_window       causal=1, window_left = w - 1 (HF's keys i - w < j <= i), no bias: the
                         window holds for every sequence length (nothing is baked for one; a
                         window sliced from a constant buffer, GPT-Neo's, at every length of it)
    sliding_window+padding  causal=1, window_left = w - 1 and the key-padding row [B, 1, 1, Sk]
                         (``ReduceMax`` of the mask over the query axis, shared by all layers:
                         the last row misses the keys before its window)
    block (constant)     ``optfuse::BlockSparseAttention`` with the BSR layout of the 128 x 128
                         tiles that hold a visible key (one row shared by the heads when they
                         agree, else per head; int32 initializers shared by equal layers),
                         causal=1 when no key lies above the diagonal, no bias when the listed
                         tiles are exactly the mask, else the mask as the bias (partial tiles);
                         see ``block_layout``. A layout listing every tile, or a mask with a row
                         that keeps no key, stays FlashAttention with the whole mask
    anything else        the mask as it is (block from shapes, bias, dynamic, unknown, ...)

  ``Where(cond, scores [+ bias2], fill)`` becomes the bias ``[bias2 +] Where(cond, 0, fill)`` (new
  nodes) when that cannot change a result: fill <= -1e30 or -inf (it absorbs the score), or a constant cond whose
  every row keeps a key and fill <= -1e4; otherwise the match is rejected.

Input-side nodes of a match (the head splits, transposes, scales and repeat_kv of q, k, v) that
something outside the match also reads stay in the graph, and the fused node reads q, k, v from
before them (``Rewrite.keep``, ``info["kept_for_other_readers"]``): DeBERTa's disentangled
attention, whose head-split q and k also feed the c2p / p2c position products, fuses with those
position scores as its additive bias. Anything after the score product that is read elsewhere
still rejects the match.

Head counts and head dims must be static: they come from shapes, or through Reshape/Transpose/
elementwise producers when shape inference left them symbolic (TorchScript's ``view(b, s, -1, d)``).
The KV heads of a repeat_kv whose input's head dim stays symbolic (a cache input that names it) are
H / G, G read from the Expand's target [B, Hkv, G, S, D] (constant entries of a target built from
``Shape``, TorchScript's ``Where(Equal(t, -1), 1, t)`` included).

Not fused (with the reason): attention probabilities that are a graph output (``output_attentions``)
or read by anything else, live dropout, a non-constant scale, unknown head counts, a head dim outside
the kernel's ``head_dims``, a mask that does not broadcast to [B, H, Sq, Sk].

Exactness. Masks are passed with their own values, so the fused op computes what the graph did.
The one exception is ``causal+padding`` and ``sliding_window+padding``: a query row whose every
visible key is padding (left padding or an all-zero mask row; with a window also a right-padded
query more than w - 1 positions past the last real key; such a row is itself a padding position)
gets the average of its causal / window keys instead of the average of all keys. Every real
token's output is exact, and so is every causal output with right padding (each row keeps key 0).
Set ``FusionOptions(attention_full_mask=True)`` (recipe ``fusions.attention_full_mask``) to pass
such masks whole with causal=0 and no window, and constant block masks to FlashAttention (exact
for every row, but the kernel then reads an Sq x Sk mask and computes the masked blocks).

The report states per attention node the mask class and window, and (``optfuse.estimate``'s
``attention_sparsity`` at the analysis dims) the density of the visited 128 x 128 tiles and the
fractions of score FLOPs and K/V reads the causal / window / layout skipping removes.

Masks are classified in the mask's dtype: values <= -1e30 (fp16: <= -3e4) or -inf mask.

Targets: ``optfuse::FlashAttention`` v2 and ``optfuse::BlockSparseAttention`` v1 (plugins/flash_attention).

Modules, by role: ``patterns`` (what the rules match), ``plan`` (one match of the decomposed and
batched rules -> the fused node's inputs and attributes), ``mask_class`` (what a mask computes),
``mask_bias`` (a classified mask -> the fused node's bias input, causal flag, window and op),
``block_layout`` (constant block masks -> BSR layouts), ``onnx_op``
(ONNX's ``Attention``), ``rules`` (the RULES list: check returns the plan, rewrite emits it).
"""


from .rules import RULES

__all__ = ["RULES"]
