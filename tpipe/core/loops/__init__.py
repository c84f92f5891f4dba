"""The tick loops: one ``lax.scan`` over ticks, one ``lax.switch`` per device and tick.

The forward loop (:mod:`.forward`: GPipe, circular), the fused loop (:mod:`.fused`: 1F1B,
interleaved, ZB-H1, ZB-V) with a fused table as its rows (:mod:`.tick_rows`), what it carries
from tick to tick (:mod:`.buffers`) and what F, B, BI and W do on one device
(:mod:`.branches`), branches run only on busy ticks (:mod:`.gated`) and inputs streamed one
micro-batch per tick (:mod:`.streaming`). Imports every layer below.
"""
