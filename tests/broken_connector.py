"""A deliberately broken connector for negative controls: it claims the same hits as
the real one but leaves the blocks unfilled, so the end-to-end comparison must fail."""

from gemma4_kv.connector import Gemma4KVConnector


class SkipLoadConnector(Gemma4KVConnector):
    def register_kv_caches(self, kv_caches) -> None:
        super().register_kv_caches(kv_caches)
        transfer = self._worker.loads.transfer
        load_by_layer = transfer.load_by_layer
        transfer.load = lambda *args, **kwargs: None
        transfer.load_by_layer = lambda loads, order: load_by_layer({}, order)
