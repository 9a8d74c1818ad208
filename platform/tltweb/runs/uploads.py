"""An upload handler that streams a multipart file straight into the artifact folder, hashing
(SHA-256) while writing: no temp copy in /tmp, no second pass over a multi-GB checkpoint."""

from __future__ import annotations

import hashlib
import uuid
from dataclasses import dataclass
from pathlib import Path

from django.core.files.uploadhandler import FileUploadHandler, StopUpload


@dataclass
class HashedUpload:
    name: str
    path: Path  # a .part file next to its final place; artifact_store renames it
    size: int
    sha256: str


class HashingUploadHandler(FileUploadHandler):
    def __init__(self, folder: Path, max_bytes: int, request=None):
        super().__init__(request)
        self.folder = Path(folder)
        self.max_bytes = max_bytes
        self._fh = None

    def new_file(self, *args, **kwargs) -> None:
        super().new_file(*args, **kwargs)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.path = self.folder / f".upload-{uuid.uuid4().hex}.part"
        self._fh = open(self.path, "wb")
        self._digest = hashlib.sha256()
        self._size = 0

    def receive_data_chunk(self, raw_data: bytes, start: int) -> None:
        self._size += len(raw_data)
        if self._size > self.max_bytes:
            self._discard()
            raise StopUpload(connection_reset=True)
        self._digest.update(raw_data)
        self._fh.write(raw_data)
        return None  # consumed: no later handler sees the chunk

    def file_complete(self, file_size: int) -> HashedUpload:
        self._fh.close()
        self._fh = None
        return HashedUpload(name=self.file_name, path=self.path, size=self._size, sha256=self._digest.hexdigest())

    def upload_interrupted(self) -> None:
        self._discard()

    def _discard(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        Path(self.path).unlink(missing_ok=True)
