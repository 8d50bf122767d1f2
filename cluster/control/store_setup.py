"""The store nodes' config: Redis (a URL given, or a local `redis-server` this process starts),
its password and HMAC key, and each Ray node's host tier."""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import subprocess
import urllib.parse

from pydantic import SecretStr

from halfmoon.cluster.config import ClusterConfig
from halfmoon.kvstore.config import StoreConfig
from halfmoon.kvstore.redis_server import start_redis_server

log = logging.getLogger(__name__)
REDIS_PASSWORD_ENV = "HALFMOON_REDIS_PASSWORD"
REDIS_HMAC_KEY_ENV = "HALFMOON_REDIS_HMAC_KEY"


class StoreSetup:
    """The store config every store node starts from, and the local Redis it may need."""

    def __init__(self, config: ClusterConfig) -> None:
        store = config.store
        self.host_memory_fraction = store.host_memory_fraction
        self.redis: subprocess.Popen | None = None
        url, password = store.redis_url, secret(store.redis_password, REDIS_PASSWORD_ENV)
        if url is None and store.use_local_redis and shutil.which("redis-server"):
            password = secrets.token_urlsafe(32)
            self.redis, url = start_redis_server(password=password)
            port = urllib.parse.urlsplit(url).port
            self._redis_args = {"port": port, "password": password}  # to start it again
        hmac_key = secret(store.redis_hmac_key, REDIS_HMAC_KEY_ENV) or secrets.token_urlsafe(32)
        self.config = store.store_config(
            redis_url=url, redis_password=password, redis_hmac_key=hmac_key
        )

    def for_node(self, node: dict) -> StoreConfig:
        """The store config for one Ray node: its host tier sized from its memory when
        `store.host_memory_fraction` is set."""
        memory = node["Resources"].get("memory", 0)
        if self.host_memory_fraction is None or memory <= 0:
            return self.config
        capacity = int(self.host_memory_fraction * memory)
        return self.config.model_copy(update={"host_capacity_bytes": capacity})

    def check_redis(self) -> bool:
        """Start the local redis-server this setup started again if it died, on its port with
        its password (empty: the store nodes reconnect, and fill it with later demotions);
        whether it did."""
        if self.redis is None or self.redis.poll() is None:
            return False
        log.error("the local redis-server died (exit %s); starting it again", self.redis.returncode)
        self.redis, _ = start_redis_server(**self._redis_args)
        return True

    def stop(self) -> None:
        """Stop the local Redis this setup started, if any."""
        if self.redis is not None:
            self.redis.terminate()
            self.redis.wait(timeout=10)
            self.redis = None


def secret(configured: SecretStr | None, env: str) -> str | None:
    """A secret from the config, else from the environment (`ray up` hands them over so)."""
    if configured is not None:
        return configured.get_secret_value()
    return os.environ.get(env) or None
