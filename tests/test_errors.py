import errno

from replay.errors import DiskError, disk_error


def test_a_refused_write_names_its_place_once_and_says_what_to_do():
    full = OSError(errno.ENOSPC, "No space left on device", "/runs/a/analysis/rows.tmp")
    said = disk_error(full, "the analysis of /runs/a/analysis", None)
    assert isinstance(said, DiskError)
    assert str(said) == ("cannot write the analysis of /runs/a/analysis: no space left on the device: free space "
                         "there, then run the command again")
    elsewhere = disk_error(OSError(errno.EROFS, "Read-only file system", "/mnt/ro/x"), "the report", None,
                           "write it elsewhere with -o FILE")
    assert str(elsewhere) == ("cannot write the report: the filesystem is read-only (/mnt/ro/x): make it writable "
                              "(remount it) or write it elsewhere with -o FILE, then run the command again")
    wrapped = RuntimeError("a library's error")
    wrapped.__cause__ = OSError(errno.EACCES, "Permission denied")
    assert "permission denied (/s)" in str(disk_error(wrapped, "the lease", "/s"))
    assert disk_error(OSError(errno.EIO, "I/O error"), "the lease", "/s") is None   # not a refusal: not said so
