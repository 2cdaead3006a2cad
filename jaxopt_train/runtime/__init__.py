"""Runtime tooling: memory limits and checks, XLA flag presets, doctor, GPU monitor, sinks,
the garbage collector frozen for a training loop."""

from jaxopt_train.runtime.collector import frozen_collector as frozen_collector
from jaxopt_train.runtime.kernel_time import KernelTime as KernelTime
from jaxopt_train.runtime.kernel_time import kernel_times as kernel_times
from jaxopt_train.runtime.memory import FitReport as FitReport
from jaxopt_train.runtime.memory import MemoryReport as MemoryReport
from jaxopt_train.runtime.memory import fits as fits
from jaxopt_train.runtime.memory import limit_memory as limit_memory
from jaxopt_train.runtime.memory import parse_bytes as parse_bytes
from jaxopt_train.runtime.memory import track_memory as track_memory
from jaxopt_train.runtime.monitor import GPUMonitor as GPUMonitor
from jaxopt_train.runtime.profiling import StepProfiler as StepProfiler
from jaxopt_train.runtime.profiling import parse_step_range as parse_step_range
from jaxopt_train.runtime.sinks import JsonlSink as JsonlSink
from jaxopt_train.runtime.sinks import MultiSink as MultiSink
from jaxopt_train.runtime.sinks import PrometheusSink as PrometheusSink
from jaxopt_train.runtime.sinks import TensorBoardSink as TensorBoardSink
from jaxopt_train.runtime.sinks import read_jsonl as read_jsonl
from jaxopt_train.runtime.xla_flags import PRESETS as XLA_FLAG_PRESETS
from jaxopt_train.runtime.xla_flags import XlaFlagsReport as XlaFlagsReport
from jaxopt_train.runtime.xla_flags import command_buffer_flags as command_buffer_flags
from jaxopt_train.runtime.xla_flags import flags_in_force as flags_in_force
from jaxopt_train.runtime.xla_flags import xla_flags as xla_flags
from jaxopt_train.runtime._backend import backend_started as backend_started
