// ---------------------------------------------------------------------------------- launcher
// tvm-ffi entry: checks every tensor against the kernel signature (all share the symbolic dim
// num_rows; contiguous; dtypes; one CUDA device), then launches one block of 1024 threads on
// the caller's stream (tvm_ffi.use_torch_stream). Refusals raise ValueError.
#include <cuda_runtime.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/extra/c_env_api.h>

namespace {

constexpr int kThreads = 1024;

template <typename T>
T* checked_data(const tvm::ffi::TensorView& t, const char* name, int arg, DLDataType dtype,
                int64_t num_rows, int64_t cols, DLDevice device) {
  const int ndim = cols == 0 ? 1 : 2;
  if (t.ndim() != ndim) {
    TVM_FFI_THROW(ValueError) << "Mismatched " << name << ".ndim on argument #" << arg
                              << ": expected " << ndim << ", got " << t.ndim();
  }
  if (t.size(0) != num_rows) {
    TVM_FFI_THROW(ValueError) << "Mismatched " << name << ".shape[0] on argument #" << arg
                              << ": expected num_rows = " << num_rows << ", got " << t.size(0);
  }
  if (cols != 0 && t.size(1) != cols) {
    TVM_FFI_THROW(ValueError) << "Mismatched " << name << ".shape[1] on argument #" << arg
                              << ": expected " << cols << ", got " << t.size(1);
  }
  if (t.dtype() != dtype) {
    TVM_FFI_THROW(ValueError) << "Mismatched " << name << ".dtype on argument #" << arg
                              << ": expected " << dtype << ", got " << t.dtype();
  }
  if (t.stride(ndim - 1) != 1 || (ndim == 2 && t.stride(0) != cols)) {
    TVM_FFI_THROW(ValueError) << "Argument #" << arg << " " << name << " is not contiguous";
  }
  if (t.device().device_type != kDLCUDA || t.device().device_id != device.device_id) {
    TVM_FFI_THROW(ValueError) << "Mismatched " << name << ".device on argument #" << arg
                              << ": expected cuda:" << device.device_id;
  }
  return reinterpret_cast<T*>(static_cast<char*>(t.data_ptr()) + t.byte_offset());
}

}  // namespace

void launch_compress_plan(tvm::ffi::TensorView row_batch_ids, tvm::ffi::TensorView positions,
                          tvm::ffi::TensorView first_new_positions,
                          tvm::ffi::TensorView request_seq_lens,
                          tvm::ffi::TensorView compress_plan, tvm::ffi::TensorView write_plan,
                          int64_t ratio, int64_t span, int64_t page) {
  const DLDataType i32{kDLInt, 32, 1};
  const DLDataType i64{kDLInt, 64, 1};
  if (positions.ndim() != 1) {
    TVM_FFI_THROW(ValueError) << "Mismatched positions.ndim on argument #1: expected 1, got "
                              << positions.ndim();
  }
  const int64_t num_rows = positions.size(0);
  const DLDevice device = positions.device();
  int* rb = checked_data<int>(row_batch_ids, "row_batch_ids", 0, i32, num_rows, 0, device);
  int64_t* pos = checked_data<int64_t>(positions, "positions", 1, i64, num_rows, 0, device);
  int64_t* first =
      checked_data<int64_t>(first_new_positions, "first_new_positions", 2, i64, num_rows, 0,
                            device);
  int* seq = checked_data<int>(request_seq_lens, "request_seq_lens", 3, i32, num_rows, 0, device);
  int* c_plan = checked_data<int>(compress_plan, "compress_plan", 4, i32, num_rows, 4, device);
  int* w_plan = checked_data<int>(write_plan, "write_plan", 5, i32, num_rows, 4, device);
  if (num_rows == 0) return;
  const int64_t chunk = (num_rows + kThreads - 1) / kThreads;  // rows per thread
  int caller_device = 0;  // launch on the tensors' device, then restore the caller's
  cudaGetDevice(&caller_device);
  cudaSetDevice(device.device_id);
  auto stream =
      static_cast<cudaStream_t>(TVMFFIEnvGetStream(device.device_type, device.device_id));
  // TVM's parameters after the buffers, sorted by name: cse_v2 = span - ratio (the overlap),
  // cse_v9 = rows per thread, then num_rows, page, ratio, span.
  compress_plan_kernel_kernel<<<1, kThreads, 0, stream>>>(
      c_plan, first, pos, seq, rb, w_plan, span - ratio, chunk, num_rows, page, ratio, span);
  const cudaError_t err = cudaGetLastError();
  cudaSetDevice(caller_device);
  if (err != cudaSuccess) {
    TVM_FFI_THROW(RuntimeError) << "compress plan kernel launch failed: "
                                << cudaGetErrorString(err);
  }
}
