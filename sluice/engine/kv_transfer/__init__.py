"""Disaggregated prefill/decode: KV blocks moved between engines (vLLM's KV connectors).

config.py     --kv-transfer-config, in vLLM's JSON shape
params.py     kv_transfer_params, the per-request contract between the two legs
connector.py  the plug point (KVConnector) the scheduler and engine call, and its factory
tcp_connector.py  the connector's bookkeeping: blocks held for a pull, blocks being loaded
tcp_transport.py  the wire: a ZMQ ROUTER serving held blocks, a DEALER pulling them
metrics.py    transfer bytes, time, fallbacks, blocks held
"""
