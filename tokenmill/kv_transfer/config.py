"""`--kv-transfer-config`, vLLM's JSON: which connector, which role, where the producer listens; and the block
layout both sides must share."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
KV_CONNECTORS = ("ZmqConnector",)
# vLLM's other keys, accepted so its configs load; they size or place buffers tokenmill does not have
_IGNORED_KEYS = {"engine_id", "kv_buffer_device", "kv_buffer_size", "kv_rank", "kv_parallel_size",
                 "kv_connector_module_path"}
_KNOWN_KEYS = {"kv_connector", "kv_role", "kv_ip", "kv_port", "kv_connector_extra_config"} | _IGNORED_KEYS


@dataclass(frozen=True)
class KVTransferConfig:
    kv_connector: str
    kv_role: str
    kv_ip: str = "127.0.0.1"
    kv_port: int = 14579            # vLLM's default
    timeout: float = 30.0           # kv_connector_extra_config.timeout: seconds a decode instance waits for blocks

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @property
    def address(self) -> str:
        """Where a producer serves its blocks (what a router passes on as kv_transfer_params.remote_address)."""
        return f"tcp://{self.kv_ip}:{self.kv_port}"


def parse_kv_transfer_config(value: str | dict | None) -> KVTransferConfig | None:
    """JSON text or a dict; every error names the field."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ValueError(f"kv_transfer_config is not valid JSON: {e}") from e
    if not isinstance(value, dict):
        raise ValueError("kv_transfer_config must be a JSON object")
    unknown = sorted(set(value) - _KNOWN_KEYS)
    if unknown:
        raise ValueError(f"kv_transfer_config: unknown key(s) {', '.join(unknown)}; known: "
                         f"{', '.join(sorted(_KNOWN_KEYS))}")
    connector = value.get("kv_connector")
    if connector not in KV_CONNECTORS:
        raise ValueError(f"kv_transfer_config.kv_connector {connector!r} is not supported; choose "
                         f"{' or '.join(KV_CONNECTORS)}")
    role = value.get("kv_role")
    if role not in KV_ROLES:
        raise ValueError(f"kv_transfer_config.kv_role {role!r} is not one of {', '.join(KV_ROLES)}")
    port = value.get("kv_port", 14579)
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        raise ValueError(f"kv_transfer_config.kv_port must be a TCP port number, got {port!r}")
    ip = value.get("kv_ip", "127.0.0.1")
    if not isinstance(ip, str) or not ip:
        raise ValueError(f"kv_transfer_config.kv_ip must be a host address, got {ip!r}")
    extra = value.get("kv_connector_extra_config") or {}
    if not isinstance(extra, dict) or set(extra) - {"timeout"}:
        raise ValueError("kv_transfer_config.kv_connector_extra_config takes only {\"timeout\": seconds}")
    timeout = extra.get("timeout", 30.0)
    if not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"kv_transfer_config.kv_connector_extra_config.timeout must be positive, got {timeout!r}")
    return KVTransferConfig(connector, role, ip, port, float(timeout))


def check_kv_transfer_params(params: Any) -> dict | None:
    """A request's kv_transfer_params (vLLM's field): {"remote_address": "tcp://host:port"} on a decode instance."""
    if params is None:
        return None
    if not isinstance(params, dict):
        raise ValueError("kv_transfer_params must be an object")
    address = params.get("remote_address")
    if address is not None and not (isinstance(address, str) and address.startswith(("tcp://", "ipc://"))):
        raise ValueError(f"kv_transfer_params.remote_address must be like tcp://host:port, got {address!r}")
    return params
