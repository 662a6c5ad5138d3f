#pragma once

// ECX_TEST_SANITIZED is 1 in a build with AddressSanitizer or ThreadSanitizer, with gcc
// (__SANITIZE_ADDRESS__, __SANITIZE_THREAD__) or clang (__has_feature), for the few tests
// that only the release tree can run (they exhaust descriptors, or measure memory).
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define ECX_TEST_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define ECX_TEST_SANITIZED 1
#endif
#endif
#ifndef ECX_TEST_SANITIZED
#define ECX_TEST_SANITIZED 0
#endif
