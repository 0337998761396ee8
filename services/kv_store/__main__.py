import sys

from moemesh.services.kv_store.config import KVStoreConfig
from moemesh.services.kv_store.service import KVStoreService
from moemesh.shared.service.cli import service_main

if __name__ == "__main__":
    sys.exit(service_main("kv_store", KVStoreConfig, KVStoreService))
