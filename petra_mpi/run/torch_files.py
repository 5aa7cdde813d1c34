"""Reading a file that torch.save wrote (a checkpoint's stage file, an exported model), which
may come from anyone: torch.load with weights_only=True, so the file may hold tensors and plain
values (dicts, lists, numbers, strings) but never an object whose unpickling runs code; every
way it can fail becomes one line that names the file and says what is wrong with it (torch's own
message suggests turning the check off: it is never shown)."""
import pickle
import re
import warnings

import torch

# The name torch's weights-only unpickler gives for what it refused ("GLOBAL posix.system").
REFUSED_NAME = re.compile(r"GLOBAL (\S+)")
NOT_TENSORS = ("not a file of tensors and plain values that torch.save wrote, or a damaged one "
               "(truncated, corrupted)")


class UnreadableFile(ValueError):
    """A file that is not a torch.save file of tensors and plain values: `path` and `why`."""

    def __init__(self, path, why):
        super().__init__(f"{path}: {why}")
        self.path, self.why = path, why


def load_tensors(path, device="cpu"):
    """What torch.save wrote to `path`, its tensors on `device`; UnreadableFile when it cannot
    be read, is not such a file, or holds anything but tensors and plain values."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch warns of a pickle protocol before refusing
            return torch.load(path, map_location=device, weights_only=True)
    except OSError as e:
        raise UnreadableFile(path, f"cannot be read ({e.strerror or e})") from None
    except pickle.UnpicklingError as e:  # the weights-only unpickler's refusals among them
        named = REFUSED_NAME.search(str(e))
        if named:
            raise UnreadableFile(path, f"refused: it holds objects other than tensors and plain "
                                       f"values ({named[1]}), and loading those could run "
                                       f"code") from None
        raise UnreadableFile(path, NOT_TENSORS) from None
    except EOFError:
        raise UnreadableFile(path, "empty or cut short: not a whole file torch.save "
                                   "wrote") from None
    except Exception:  # noqa: BLE001 - a damaged or foreign file fails anywhere in torch.load
        raise UnreadableFile(path, NOT_TENSORS) from None


def first_non_finite(tensors: dict):
    """The name of the first floating-point tensor of `tensors` (name -> tensor) holding a NaN
    or an infinity, or None."""
    for name, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            return name
    return None


def state_misfit(own: dict, saved: dict):
    """Why the tensors `saved` (name -> tensor) do not load into a module whose own state is
    `own` (name -> tensor): a name missing or extra, or another shape; None when they fit."""
    for name in own.keys() - saved.keys():
        return f"{name} is missing"
    for name in saved.keys() - own.keys():
        return f"{name} is not a tensor of the model"
    for name, t in own.items():
        if saved[name].shape != t.shape:
            return (f"{name} has shape {tuple(saved[name].shape)}, the model's is "
                    f"{tuple(t.shape)}")
    return None
