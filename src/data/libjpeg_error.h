// libjpeg's error handling for the data layer's decoder and encoder (internal): errors leave
// through longjmp to the caller's setjmp with libjpeg's message, and nothing is printed.
#pragma once
#include <csetjmp>
#include <cstdio>

#include <jpeglib.h>

namespace vitgrid {
namespace libjpeg {

struct Error {
  jpeg_error_mgr pub;  // first: libjpeg casts cinfo->err to this
  std::jmp_buf jump;
  char message[JMSG_LENGTH_MAX];
};

[[noreturn]] inline void fail(j_common_ptr cinfo) {
  Error* e = reinterpret_cast<Error*>(cinfo->err);
  (*cinfo->err->format_message)(cinfo, e->message);
  std::longjmp(e->jump, 1);
}

inline void silent(j_common_ptr) {}

// err's handlers (fail, silent); returns err.pub for cinfo.err.
inline jpeg_error_mgr* install(Error& err) {
  jpeg_error_mgr* p = jpeg_std_error(&err.pub);
  err.pub.error_exit = fail;
  err.pub.output_message = silent;
  err.message[0] = 0;
  return p;
}

}  // namespace libjpeg
}  // namespace vitgrid
