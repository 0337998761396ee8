import sys

from moemesh.services.decode.config import DecodeConfig
from moemesh.services.decode.service import DecodeService
from moemesh.shared.service.cli import service_main

if __name__ == "__main__":
    sys.exit(service_main("decode", DecodeConfig, DecodeService))
