"""One typed settings object for a kvd daemon.

Sources, lowest to highest priority: built-in defaults < TOML file
(``kvd serve --config FILE``) < ``KVD_*`` environment variables (and the
reference connector's ``SGLANG_DISAGGREGATION_*`` names for the settings it
has) < explicit overrides (command-line flags). Invalid settings raise
:class:`~kvd.errors.ConfigError` listing every problem at once.
"""

from __future__ import annotations

import os
import tomllib
import uuid
from pathlib import Path
from typing import Any, Literal

from pydantic import AliasChoices, Field, ValidationError, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from kvd.errors import ConfigError


def _aliases(name: str, sglang: str | None = None) -> AliasChoices:
    """Accept the field name, ``KVD_<NAME>`` and optionally an SGLang env name."""
    names = [name, f"KVD_{name.upper()}"]
    if sglang:
        names.append(f"SGLANG_DISAGGREGATION_{sglang}")
    return AliasChoices(*names)


class Settings(BaseSettings):
    """Effective configuration of one kvd daemon (one engine rank).

    Units: seconds for every ``*_timeout``/``*_interval``; bytes for sizes.
    Port 0 means "pick a free port" (the chosen one is logged and reported).
    """

    model_config = SettingsConfigDict(extra="forbid", populate_by_name=True)

    role: Literal["prefill", "decode"] = Field(validation_alias=_aliases("role"))
    host: str = Field("127.0.0.1", validation_alias=_aliases("host"),
                      description="address advertised to peers (ZMQ and transfer engine)")
    http_host: str = Field("127.0.0.1", validation_alias=_aliases("http_host"))
    http_port: int = Field(0, ge=0, le=65535, validation_alias=_aliases("http_port"))
    zmq_port: int = Field(0, ge=0, le=65535, validation_alias=_aliases("zmq_port"))
    engine_socket: Path = Field(Path("/tmp/kvd.sock"), validation_alias=_aliases("engine_socket"))
    serve_bootstrap: bool = Field(False, validation_alias=_aliases("serve_bootstrap"),
                                  description="serve SGLang's /route API on the HTTP port")
    bootstrap_addr: str | None = Field(None, validation_alias=_aliases("bootstrap_addr"),
                                       description="host:port where a prefill rank registers")
    shm_dir: Path = Field(Path("/dev/shm"), validation_alias=_aliases("shm_dir"),
                          description="only shared-memory files under this folder are mapped")

    attn_tp_size: int = Field(1, ge=1, validation_alias=_aliases("attn_tp_size"))
    attn_tp_rank: int = Field(0, ge=0, validation_alias=_aliases("attn_tp_rank"))
    attn_dp_size: int = Field(1, ge=1, validation_alias=_aliases("attn_dp_size"))
    attn_dp_rank: int = Field(0, ge=0, validation_alias=_aliases("attn_dp_rank"))
    pp_size: int = Field(1, ge=1, validation_alias=_aliases("pp_size"))
    pp_rank: int = Field(0, ge=0, validation_alias=_aliases("pp_rank"))

    bootstrap_timeout: float = Field(
        300.0, gt=0, validation_alias=_aliases("bootstrap_timeout", "BOOTSTRAP_TIMEOUT"))
    waiting_timeout: float = Field(
        300.0, gt=0, validation_alias=_aliases("waiting_timeout", "WAITING_TIMEOUT"))
    transfer_timeout: float = Field(120.0, gt=0, validation_alias=_aliases("transfer_timeout"))
    heartbeat_interval: float = Field(
        5.0, gt=0, validation_alias=_aliases("heartbeat_interval", "HEARTBEAT_INTERVAL"))
    heartbeat_max_failures: int = Field(
        2, ge=1, validation_alias=_aliases("heartbeat_max_failures", "HEARTBEAT_MAX_FAILURE"))
    transfer_threads: int = Field(
        1, ge=1, le=64, validation_alias=_aliases("transfer_threads", "THREAD_POOL_SIZE"))
    transfer_queue_size: int = Field(
        4, ge=1, validation_alias=_aliases("transfer_queue_size", "QUEUE_SIZE"))
    max_batch_entries: int = Field(
        512, ge=1, le=1024, validation_alias=_aliases("max_batch_entries"),
        description="descriptors per Mooncake batch call (the TCP transport refuses > 1024)")
    control_send_timeout: float = Field(
        5.0, gt=0, validation_alias=_aliases("control_send_timeout"))
    http_timeout: float = Field(5.0, gt=0, validation_alias=_aliases("http_timeout"))
    bootstrap_retry_budget: float = Field(
        30.0, gt=0, validation_alias=_aliases("bootstrap_retry_budget"),
        description="how long lookups/registration keep retrying before failing")
    max_frame_bytes: int = Field(64 << 20, ge=1024, validation_alias=_aliases("max_frame_bytes"))
    log_level: str = Field("INFO", validation_alias=_aliases("log_level"))

    instance_id: str = Field(default_factory=lambda: uuid.uuid4().hex[:16])

    @model_validator(mode="after")
    def _check_ranks(self) -> Settings:
        problems = []
        for rank, size in (("attn_tp_rank", "attn_tp_size"), ("attn_dp_rank", "attn_dp_size"),
                           ("pp_rank", "pp_size")):
            if getattr(self, rank) >= getattr(self, size):
                problems.append(f"{rank}={getattr(self, rank)} must be < {size}="
                                f"{getattr(self, size)}")
        if self.role == "prefill" and not (self.bootstrap_addr or self.serve_bootstrap):
            problems.append("a prefill kvd needs bootstrap_addr (or serve_bootstrap = true)")
        if problems:
            raise ValueError("; ".join(problems))
        return self


def _settings_class(toml_file: Path | None) -> type[Settings]:
    """A Settings subclass whose file source is ``toml_file`` (env still wins over it)."""

    class _FileSettings(Settings):
        @classmethod
        def settings_customise_sources(
            cls,
            settings_cls: type[BaseSettings],
            init_settings: PydanticBaseSettingsSource,
            env_settings: PydanticBaseSettingsSource,
            dotenv_settings: PydanticBaseSettingsSource,
            file_secret_settings: PydanticBaseSettingsSource,
        ) -> tuple[PydanticBaseSettingsSource, ...]:
            sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
            if toml_file is not None:
                sources.append(TomlConfigSettingsSource(settings_cls, toml_file=toml_file))
            return tuple(sources)

    return _FileSettings


def load_settings(config_file: str | Path | None = None, **overrides: Any) -> Settings:
    """Build the effective :class:`Settings`.

    ``overrides`` are command-line values (``None`` values are ignored).
    Raises :class:`ConfigError` listing every invalid entry, or naming the
    unreadable file.
    """
    path = Path(config_file) if config_file is not None else None
    if path is not None:
        try:
            with path.open("rb") as fh:
                tomllib.load(fh)
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"cannot read config file {path}: {exc}") from exc
    cli = {k: v for k, v in overrides.items() if v is not None}
    try:
        return _settings_class(path)(**cli)
    except ValidationError as exc:
        lines = [f"  {'.'.join(str(p) for p in e['loc']) or 'settings'}: {e['msg']}"
                 for e in exc.errors()]
        raise ConfigError("invalid kvd configuration:\n" + "\n".join(lines)) from exc


def env_snapshot() -> dict[str, str]:
    """The KVD_* and SGLANG_DISAGGREGATION_* variables in the environment (for reports)."""
    return {k: v for k, v in os.environ.items()
            if k.startswith(("KVD_", "SGLANG_DISAGGREGATION_"))}
