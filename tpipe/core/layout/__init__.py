"""Where a planned sequence's variables live on the stages, and the way back.

The stage layout's description (:mod:`.description`: stacked, packed and shared leaves, places,
partition specs: :class:`~tpipe.core.layout.description.StageLayout`); one chunk's packing
(:mod:`.pack`), bytes and masks (:mod:`.accounting`), whole trees logical to staged and back
(:mod:`.staging`), a device's view of the staged tree (:mod:`.device_view`), a checkpoint's
layout-independent form (:mod:`.checkpoint_form`) and relayout a part at a time
(:mod:`.relayout`). Imports :mod:`tpipe.core.planning` and :mod:`tpipe.core.base`.
"""
